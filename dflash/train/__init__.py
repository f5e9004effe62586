"""The torchrun training job and only it (libraries never import this package).

``python -m dflash.train`` runs :func:`dflash.train.job.main`: compose -> validate -> claim the run
dir -> prepare -> init dist -> build this rank's role -> run. The roles are the target worker
(``target_worker``, with ``packets``) and the drafter trainer (``trainer``, with ``step_stats`` and
``periodic_eval``); ``setup`` derives what every rank needs before the process group; ``run_dir``,
``checkpoint``, ``rng_state``, ``steplog`` and ``summary`` are what a run writes; ``faults`` injects
failures for the reliability tests.
"""
