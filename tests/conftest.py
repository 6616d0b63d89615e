import os
import tempfile

# Tests run on the CPU; the mesh tests ask for 8 simulated devices themselves.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Many tests build the same small programs again (a fresh jit per trainer); a persistent
# compilation cache turns those recompiles into disk reads.
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("RELAX_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "relax-test-jax-cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
