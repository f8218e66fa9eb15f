"""`python -m tensorwire ...` behaves like the `tensorwire` script."""

from .tools.cli import main

raise SystemExit(main())
