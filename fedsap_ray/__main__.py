from fedsap_ray.cli import main

raise SystemExit(main())
