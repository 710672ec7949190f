"""What every part shares, depending on nothing: exceptions, seeding, the typed messages, declared columns.

May import: nothing.

These are the words the other folders speak to each other in (a ``ConfigError``, a ``ClientPlan``, a
``Column``); keeping them below everything is what lets any folder raise, send or declare one without an
upward import.
"""
