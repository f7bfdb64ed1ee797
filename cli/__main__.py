"""`python -m kvstore.cli`: the `kvstore` command."""

from kvstore.cli import main

raise SystemExit(main())
