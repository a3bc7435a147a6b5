"""``python -m gpufeed.cli``: the ``gpufeed`` command, as before the CLI became a package (``python -m gpufeed``
is the documented form)."""

from gpufeed.cli import main

main()
