"""One round: plans -> training -> aggregation -> evaluation, synchronous or asynchronous.

May import: common, config, persist, models, data, algorithms.

The round loop (``server``), a client's local training (``client``), evaluation (``evaluate``), the asynchronous
engine on the simulated clock (``asyncmode``; the staleness weights it applies are ``algorithms.staleness``, as
strategies apply them too) and what a round returns (``summary``). The engine
writes no table: the session hands it a recorder (``server.RoundRecorder``), so nothing here imports ``results/``.
"""
