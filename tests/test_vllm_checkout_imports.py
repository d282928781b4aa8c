"""A checkout on sys.path claims no generic top-level name (DESIGN.md, Layout): the `kernels/`
folder imported as a bare `kernels` (as it is from the repository root) is an empty namespace-like
module, so transformers does not take it for Hugging Face's `kernels` package. On b90e890 it was
tierd's whole kernel package under that name: transformers imported it while importing itself
(torch, and tierd, which a vLLM environment need not have: `import vllm.distributed.kv_events`
then failed with "No module named 'tierd.engine'")."""

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
from transformers.utils.import_utils import _is_package_available, is_kernels_available
print(json.dumps({"file": getattr(kernels, "__file__", None),
                  "names": [n for n in vars(kernels) if not n.startswith("__")], "submodules": list(kernels.__path__),
                  "transformers": list(_is_package_available("kernels", return_version=True)),
                  "available": is_kernels_available()}))
"""


def _python(py: str, code: str, **kw) -> subprocess.CompletedProcess:
    # from the repository root: sys.path[0] is the checkout, as for `python -c` or pytest there
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    env.pop("PYTHONPATH", None)
    return vllm_wait.run_script([py, "-c", code], f"python -c in the checkout ({py})", cwd=ROOT, env=env, **kw)


def test_bare_kernels_from_the_checkout_is_an_empty_module_transformers_ignores():
    # as in an environment without tierd: importing the bare name must not need it
    r = _python(sys.executable, "import sys; sys.modules['tierd'] = None\n" + BARE)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"] is None and got["names"] == [] and got["submodules"] == []
    assert got["transformers"] == [False, "N/A"] and got["available"] is False


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
def test_vllm_imports_from_the_checkout_in_an_environment_without_tierd():
    py = vllm_python("cpu-build")
    if py is None:
        if os.environ.get("TEST_REQUIRE_VLLM"):
            pytest.fail(f"the vLLM environment {VLLM_ENVS['cpu-build']} is part of this suite here, and it is missing")
        pytest.skip(f"no {VLLM_ENVS['cpu-build']} environment; `make vllm-env` builds it")
    r = _python(py, "import sys; sys.modules['tierd'] = None\n"
                "import vllm.distributed.kv_events\n" + BARE)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["transformers"] == [False, "N/A"] and got["file"] is None
