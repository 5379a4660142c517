import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# Without a GPU, Triton kernels run in its CPU interpreter; the flag must be set before triton's first import
# (lowbit/kernels/_triton.py), i.e. here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def embedded_model_dir():
    """The embedded SmolLM2-135M converted into the store (once per machine, ~30 s)."""
    from lowbit.models import DEFAULT_MODEL, resolve

    return resolve(DEFAULT_MODEL)
