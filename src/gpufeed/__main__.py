"""``python -m gpufeed``: the ``gpufeed`` command (shell completion included, as ``_GPUFEED_COMPLETE``)."""

from gpufeed.cli import main

if __name__ == "__main__":
    main()
