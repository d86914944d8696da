"""``python -m bench.tenancy``: the soak's command line (:mod:`bench.tenancy.cli`)."""

from bench.tenancy.cli import main

raise SystemExit(main())
