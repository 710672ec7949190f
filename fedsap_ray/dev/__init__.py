"""Development tools, not library API: golden numbers (a refactor changed no number) and the reference-page generator.

May import: everything.

Nothing in the library imports this folder (tests/test_architecture.py), so a tool may reach any part
of the package, the root modules included, without closing a cycle. Both run as commands:
``python -m fedsap_ray.dev.golden`` and ``python -m fedsap_ray.dev.docgen``.
"""
