"""A checkout on sys.path claims no generic top-level name (DESIGN.md, Layout): the `kernels/`
folder imported as a bare `kernels` (as it is from the repository root) is Hugging Face's `kernels`
package where that is installed (transformers depends on it from 5.25 and imports it while
importing itself), and an empty namespace-like module transformers ignores where it is not. On
b90e890 it was tierd's whole kernel package under that name: transformers imported it while
importing itself (torch, and tierd, which a vLLM environment need not have: `import
vllm.distributed.kv_events` then failed with "No module named 'tierd.engine'"); on aa16079 it was
the empty module even beside an installed `kernels` 0.19.1, and `import transformers.activations`
failed with "cannot import name 'CUDAProperties' from 'kernels'"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from . import vllm_wait
from .test_vllm_connector import ROOT, VLLM_ENVS, vllm_python

BARE = """
import json, sys
import kernels
from transformers import LlamaConfig
from transformers.utils.import_utils import _is_package_available, is_kernels_available
LlamaConfig(hidden_size=64, num_attention_heads=4)
print(json.dumps({"file": getattr(kernels, "__file__", None), "version": getattr(kernels, "__version__", None),
                  "names": [n for n in vars(kernels) if not n.startswith("__")],
                  "submodules": list(getattr(kernels, "__path__", [])),
                  "transformers": list(_is_package_available("kernels", return_version=True)),
                  "available": is_kernels_available()}))
"""


def _python(py: str, code: str, cwd=ROOT, **kw) -> subprocess.CompletedProcess:
    # from the repository root: sys.path[0] is the checkout, as for `python -c` or pytest there
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("PYTHONPATH", None)
    return vllm_wait.run_script([py, "-c", code], f"python -c in {cwd} ({py})", cwd=cwd, env=env, **kw)


def _installed_kernels(py: str, elsewhere) -> tuple[str, str] | None:
    """Where `py`'s environment has Hugging Face's `kernels`, and its version, looked up from a
    folder that is not the checkout; None where it has none."""
    r = _python(py, "import importlib.util, importlib.metadata as m, json\n"
                    "s = importlib.util.find_spec('kernels')\n"
                    "print(json.dumps(s and [s.origin, m.version('kernels')]))", cwd=elsewhere)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return tuple(got) if got else None


def _check_bare_kernels(py: str, elsewhere, prelude: str = "") -> None:
    """Imports the bare `kernels`, then transformers, from the checkout in `py`'s environment, as
    in one without tierd: Hugging Face's package where the environment has it, else nothing."""
    installed = _installed_kernels(py, elsewhere)
    r = _python(py, "import sys; sys.modules['tierd'] = None\n" + prelude + BARE)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if installed is None:
        assert got["file"] is None and got["names"] == [] and got["submodules"] == []
        assert got["transformers"] == [False, "N/A"] and got["available"] is False
    else:
        origin, version = installed
        assert got["file"] == origin != str(ROOT / "kernels" / "__init__.py")
        assert got["version"] == version and got["transformers"] == [True, version] and got["available"] is True


def test_bare_kernels_from_the_checkout_is_the_installed_package_or_an_empty_module(tmp_path):
    _check_bare_kernels(sys.executable, tmp_path)


def test_tierd_kernels_is_the_package():
    r = _python(sys.executable, "import kernels, tierd.kernels as k, json\n"
                "print(json.dumps([k.__file__, k.gather_blocks.name, sorted(k.status('cpu')), k.reference.__name__,"
                " hasattr(kernels, 'gather_blocks')]))")
    assert r.returncode == 0, r.stderr[-3000:]
    path, name, ops, ref, bare_has = json.loads(r.stdout.strip().splitlines()[-1])
    assert path == str(ROOT / "kernels" / "__init__.py") and name == "gather_blocks"
    assert "paged_attention_decode" in ops and ref == "tierd.kernels.reference" and not bare_has


@pytest.mark.slow
@pytest.mark.timeout(vllm_wait.SCRIPT_S + 60)
def test_vllm_imports_from_the_checkout_in_an_environment_without_tierd(tmp_path):
    py = vllm_python("cpu-build")
    if py is None:
        if os.environ.get("TEST_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM environment {VLLM_ENVS['cpu-build']} is part of this suite here, and it is missing")
        pytest.skip(f"no {VLLM_ENVS['cpu-build']} environment; `make vllm-env` builds it")
    _check_bare_kernels(py, tmp_path, prelude="import vllm.distributed.kv_events\n")
