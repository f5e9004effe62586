"""The planner: how to use a world of GPUs for a config, on the cost and memory models of
:mod:`dflash.sizing`.

``gpus.py``       the GPU of ``plan.gpu`` (datasheet profiles, or ``auto``'s probe) and the planner's inputs
``throughput.py`` packets/s of every N:M split and of the co-located mode (pure Python)
``planner.py``    the plan of one config; ``search.py`` the packet size, cap, sharding and split that train
                  the most signal; ``tables.py`` its table and JSON; ``app.py`` ``python -m dflash.plan``
``rehearse.py``   one real-size step per role on fake tensors (``plan.measure=true``)
"""
