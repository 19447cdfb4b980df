"""examples/quickstart.ipynb runs top to bottom on CPU against the shipped stories260K without a
cell error (nbclient), in a kernel running this interpreter; its asserting cells check real values
(greedy text = llama2.c's, streamed deltas = the text, greedy tokens likeliest in the temperature
sweep, prompt logprobs = perplexity, the right multiple-choice answer ranked first)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbclient  # the test extra has nbclient, nbformat, ipykernel: a missing one fails, not skips
import nbformat
import pytest
from conftest import SHARED

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300  # per cell, for a loaded machine; the whole notebook takes ~15 s cold on CPU


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook executed in a kernel of ``sys.executable`` (a kernelspec written to a temp
    dir, so neither an installed "python3" kernel nor ``ipykernel install`` is needed)."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    kdir = tmp_path_factory.mktemp("kernels")
    write_kernel_spec(str(kdir / "jaxinfer-test"), overrides={"display_name": "jaxinfer test"})
    ksm = KernelSpecManager(kernel_dirs=[str(kdir)], ensure_native_kernel=False)
    assert ksm.get_kernel_spec("jaxinfer-test").argv[0] == sys.executable
    km = KernelManager(kernel_name="jaxinfer-test", kernel_spec_manager=ksm)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {**os.environ, "JAXINFER_SHARED": str(SHARED)}
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    old = dict(os.environ)
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client.execute()  # raises CellExecutionError naming the cell on any error
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def test_notebook_runs(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)  # every cell ran
    text = "".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    assert "Once upon a time, there was a little girl named Lily." in text
    assert "answer: ball" in text
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the temperature sweep's plot
