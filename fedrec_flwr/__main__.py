"""``python -m fedrec_flwr``: the ``fedrec`` command (:mod:`fedrec_flwr.cli`) without the installed script."""

import sys

from fedrec_flwr.cli import main

sys.exit(main())
