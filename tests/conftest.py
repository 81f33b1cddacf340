import os

# Triton kernels run in the interpreter on CPU; this must be set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
