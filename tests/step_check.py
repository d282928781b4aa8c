"""Run under Triton's interpreter (TRITON_INTERPRET=1, on the CPU) by tests/test_triton.py: the
engine with the op set a GPU runs -- the fused Triton norm, rotary and gate kernels and the
Triton decode kernel -- and its one-token step through static buffers (what a CUDA graph
captures, tierd/engine/graphs.py), against the engine's torch code, and the launches of one
decode step counted. Prints one line per check and "step check: OK" at the end.

Counting: every torch op that runs a kernel counts one launch (views, allocations and other
metadata-only ops count none), every Triton kernel launch one, and the cache write one (on CUDA
it is one kernel, `ops.reshape_and_cache`; here its torch reference runs, uncounted inside).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_LAUNCH = {"view", "_unsafe_view", "slice", "select", "split", "split_with_sizes", "t", "transpose",
             "permute", "unsqueeze", "squeeze", "expand", "as_strided", "alias", "detach", "empty",
             "empty_like", "empty_strided", "_reshape_alias", "lift_fresh", "unbind", "chunk"}


class Launches(TorchDispatchMode):
    """Counts launches (see the module's docstring); `quiet` parts count as one."""

    def __init__(self):
        super().__init__()
        self.count, self.depth, self.ops = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if self.depth == 0 and name not in NO_LAUNCH and not self._alias(name, args, out):
            self.count += 1
            self.ops.append(name)
        return out

    @staticmethod
    def _alias(name, args, out) -> bool:
        """An op that returned a view of an input (`to` with nothing to convert, `reshape` of
        contiguous rows): it ran no kernel. In-place ops (name_) return their input and do."""
        if name.endswith("_") or not isinstance(out, torch.Tensor):
            return False
        def storage(t):     # (oneDNN's packed weights have no storage)
            return None if t.is_mkldnn else t.untyped_storage().data_ptr()
        return storage(out) in {storage(a) for a in args if isinstance(a, torch.Tensor)} - {None}

    def one(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.depth == 0:
                self.count += 1
                self.ops.append(name)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return wrapped


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    from triton.runtime import interpreter

    import tierd.kernels as K
    from tierd.engine import LLM, SamplingParams, attention
    from tierd.engine.random_model import write_random_model
    from tierd.kernels import reference

    tmp = tempfile.mkdtemp()
    counter = Launches()
    run = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = lambda self, *a, **k: counter.one("triton", run)(self, *a, **k)

    # 1. the GPU's op set and the static step give the engine's torch outputs
    d = write_random_model(f"{tmp}/llama", seed=0, num_hidden_layers=2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in (17, 40, 23, 5)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    own = LLM(d, kv_cache_bytes="4MiB")
    own.model._ops = (attention.reshape_and_cache, None, reference.add_rms_norm, reference.rotary,
                      reference.silu_mul)
    want = own.generate(prompt_token_ids=prompts, sampling_params=params)
    gpu_set = LLM(d, kv_cache_bytes="4MiB", cuda_graphs=True)
    ops = gpu_set.model.ops()
    assert ops[1] is K.decode_attention and all(op.use_kernel(torch.device("cpu"))
                                                for op in (K.add_rms_norm, K.rotary, K.silu_mul)), \
        [op.status(torch.device("cpu")) for op in (K.add_rms_norm, K.rotary, K.silu_mul)]
    got = gpu_set.generate(prompt_token_ids=prompts, sampling_params=params)
    worst = 0.0
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].token_ids, b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            (ta, x), = la.items()
            worst = max(worst, abs(x.logprob - lb[ta].logprob))
    assert worst < 1e-4, worst
    stats = gpu_set.graphs.stats()
    assert stats["eager_steps"] > 0, stats
    print(f"fused Triton ops and the static decode step: greedy tokens equal the torch path's, "
          f"logprobs within {worst:.2g}; {stats['eager_steps']} steps through the static buffers")

    # queries and keys in tensors of their own: the kernel declines them (one launch must cover
    # both, so that an in-place op is never left half done) and the dispatcher's reference serves
    from tierd.kernels import triton_fused
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float16):
        q, k = torch.randn(5, 8, 64, generator=g).to(dtype), torch.randn(5, 2, 64, generator=g).to(dtype)
        pos = torch.tensor([0, 3, 100, 4095, 20000])
        inv = (1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))).float()
        q2, k2 = q.clone(), k.clone()
        reference.rotary(q, k, pos, inv)
        try:
            triton_fused.rotary(q2.clone(), k2.clone(), pos, inv)
            raise AssertionError("separate q and k were taken")
        except ValueError:
            pass
        counter.count = 0
        K.rotary(q2, k2, pos, inv)
        assert counter.count == 0 and torch.equal(q2, q) and torch.equal(k2, k)
    print("rotary on separate queries and keys: declined by the kernel, the reference's values")

    # 2. launches of one decode step: per layer a constant, the same for any batch and context
    counts = {}
    for layers in (2, 4):
        d = write_random_model(f"{tmp}/l{layers}", seed=0, num_hidden_layers=layers)
        llm = LLM(d, kv_cache_bytes="8MiB", cuda_graphs=True, max_model_len=2048)
        m, g = llm.model, llm.graphs
        cache_op, decode, norm, rotary, silu_mul = m.ops()
        m._ops = (counter.one("reshape_and_cache", cache_op), decode, norm, rotary, silu_mul)
        for batch, ctx in ((1, 30), (3, 200), (4, 1100)):
            tables = [list(range(i * 100, i * 100 + -(-ctx // 16))) for i in range(batch)]
            lengths = [ctx - i for i in range(batch)]
            args = ([7] * batch, [n - 1 for n in lengths], [-1] * batch, tables, lengths)
            g.run(*args)                               # (first use: self-checks)
            counter.count, counter.ops = 0, []
            with counter:
                g.run(*args)
            counts[(layers, batch, ctx)] = counter.count
            if (layers, batch) == (2, 1):
                print("  " + " ".join(counter.ops))
            print(f"{layers} layers, batch {batch}, context {ctx}: {counter.count} launches per step")
        m._ops = None
    per_layer = (counts[(4, 1, 30)] - counts[(2, 1, 30)]) / 2
    fixed = counts[(2, 1, 30)] - 2 * per_layer
    for (layers, batch, ctx), n in counts.items():
        # split-KV adds one merge launch per layer where a context is cut into spans
        assert n <= fixed + layers * (per_layer + 1), (layers, batch, ctx, n)
    assert per_layer <= 11 and fixed <= 6, (per_layer, fixed)
    print(f"launches per step: {per_layer:g} per layer + {fixed:g}, for any batch and context")

    # the torch op set, for comparison (what a GPU ran before the fused kernels)
    llm.model._ops = (counter.one("reshape_and_cache", attention.reshape_and_cache), decode,
                      reference.add_rms_norm, reference.rotary, reference.silu_mul)
    counter.count = 0
    with counter:
        llm.graphs.run(*args)
    print(f"the torch element-wise ops instead: {counter.count} launches per step ({layers} layers)")
    assert counter.count > counts[(4, 4, 1100)]
    print("step check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
