"""Each rank's entry point under torchrun, and the launcher's torchrun: ``python -m gpufeed.train CONFIG`` and
``python -m gpufeed.train --torchrun ARGS`` (:func:`gpufeed.train.launch.main`, docs/design.md §6)."""

import sys

from gpufeed.train.launch import main

sys.exit(main())
