import os

# Tests run on the CPU; the mesh tests ask for 8 simulated devices themselves.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
