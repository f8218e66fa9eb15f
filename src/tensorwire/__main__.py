"""`python -m tensorwire ...` behaves like the `tensorwire` script."""

from tensorwire.cli import main

raise SystemExit(main())
