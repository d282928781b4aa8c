"""The store's namespaces: the table (`NamespaceTable`: each namespace's state, by id and by the
name clients use, which of them may be forgotten, and those known only from a tier's blocks).
Memory only, under the store's lock."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..arena import slot_bytes_for
from ..errors import TierdError, UnknownNamespaceError
from ..namespace import Namespace
from ..tiers.disk import DiskTier
from .records import NsState


class NamespaceTable:
    """Each namespace's state (`NsState`), by id and, once registered with its description, by
    name. Memory only, under the store's lock.

    Invariants kept here: one state per namespace id in the table; a state leaves it only in
    `forget`, and only while nothing refers to it — no block record (`st.records`) and no staged
    slot (`st.staged`); a forgotten state comes back only through `live`, and never over a
    state registered since."""

    def __init__(self):
        self._by_id: dict[bytes, NsState] = {}
        self._by_name: dict[str, NsState] = {}

    def get(self, ns_id: bytes) -> NsState | None:
        return self._by_id.get(ns_id)

    def named(self, name: str) -> NsState | None:
        """The registered state that clients call `name`."""
        return self._by_name.get(name)

    def find(self, text) -> NsState | None:
        """The state whose id, name or hex id is `text` (registered or known only from a tier)."""
        st = self._by_name.get(text) if isinstance(text, str) else None
        if st is not None:
            return st
        for st in self._by_id.values():
            if text in (st.ns_id, st.name, st.ns_id.hex()):
                return st
        return None

    def enter(self, st: NsState) -> None:
        """Put `st` in the table (by name too once it has its description)."""
        self._by_id[st.ns_id] = st
        if st.ns is not None:
            self._by_name[st.name] = st

    def live(self, st: NsState) -> NsState:
        """The table's state of `st`'s namespace. An operation that let go of the lock may hold
        a state forgotten meanwhile: its blocks go to the state registered since, or it is
        entered again, so one namespace never has two states."""
        if not st.forgotten:
            return st
        current = self._by_id.get(st.ns_id)
        if current is not None:
            return current
        st.forgotten = False
        self.enter(st)
        return st

    def forget(self, names: Iterable[str]) -> list[str]:
        """Forget the registered namespaces among `names` that nothing refers to; the names
        forgotten (those not in the table count as forgotten)."""
        gone = []
        for name in names:
            st = self._by_name.get(name)
            if st is None:
                gone.append(name)    # forgotten already (another uid's request)
                continue
            if st.records or st.staged or st.forgotten:
                continue
            st.forgotten = True
            del self._by_name[name]
            self._by_id.pop(st.ns_id, None)
            gone.append(name)
        return gone

    def recovered(self, ns_id: bytes, block_bytes: int, desc: dict) -> NsState:
        """Enter a namespace known only from blocks found at open (on disk, or in
        an earlier host arena) with the description stored beside them, if any; it is
        completed when a client registers it."""
        dtype_bytes = 2
        if desc:
            try:
                dtype_bytes = Namespace.from_dict(desc).dtype_bytes
            except TierdError:
                desc = {}
        st = NsState(ns_id, None, block_bytes, dtype_bytes, slot_bytes_for(block_bytes),
                     DiskTier.slot_bytes_for(block_bytes), desc)
        self.enter(st)
        return st

    def state(self, ns, host, disk) -> NsState:
        """The state of `ns`: a Namespace (entered, and its blocks checked against the `host`
        and `disk` tiers, on first use), or the name or id of a registered one."""
        if isinstance(ns, Namespace):
            st = self._by_id.get(ns.id)
            if st is not None and st.ns is not None:
                if ns.label and ns.label != st.label:
                    st.label = ns.label
                return st
            whose = f"of namespace {ns.name} "
            host_sb = host.check_block(ns.block_bytes, whose)
            disk_sb = DiskTier.slot_bytes_for(ns.block_bytes)
            if disk is not None:
                disk.check_block(ns.block_bytes, whose)
            if st is None:
                st = NsState(ns.id, ns, ns.block_bytes, ns.dtype_bytes, host_sb, disk_sb, ns.to_dict())
            else:  # known from disk: attach the description
                st.ns, st.desc = ns, ns.to_dict()
            st.label = ns.label or st.label
            self.enter(st)   # by the name clients use too (the daemon's protocol)
            return st
        if isinstance(ns, (bytes, str)):
            st = self.find(ns)
            if st is not None:
                if st.ns is None:
                    raise UnknownNamespaceError(
                        f"namespace {st.name} is known only from disk; register it with its Namespace first")
                return st
            raise UnknownNamespaceError(
                f"unknown namespace {ns if isinstance(ns, str) else ns.hex()!r}; pass a tierd.Namespace "
                "or the name of a registered one (see stats)")
        raise TypeError(f"expected a tierd.Namespace, got {type(ns).__name__}")

    def flush_scope(self, namespace) -> bytes:
        """The id of the namespace a flush names (a Namespace, or a name or id in the table)."""
        if isinstance(namespace, Namespace):
            return namespace.id
        st = self.find(namespace)
        if st is not None:
            return st.ns_id
        raise UnknownNamespaceError(f"flush: unknown namespace {namespace!r}")

    def values(self) -> Iterator[NsState]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)
