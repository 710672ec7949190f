"""One run's server side and the loop that drives it: the session, its checks before writing, resume, progress, trackers.

May import: common, config, persist, models, data, algorithms, engine, results.

A :class:`~fedsap_ray.run.session.RunSession` builds a run (context, strategy, recorder, engine, writer) and
steps it; ``resume`` checks a checkpoint against the run before anything is rewritten; ``guard`` is what a run
checks before it writes; ``driver`` is the one loop (local runs, Ray runs, Tune trials) with its callbacks
(``progress``, ``trackers``). Hosting a session elsewhere is ``runtime/``'s job, above this folder.
"""
