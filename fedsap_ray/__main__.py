"""``python -m fedsap_ray``: the ``fedsap-ray`` command."""
from fedsap_ray.cli import main

raise SystemExit(main())
