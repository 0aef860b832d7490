"""``python -m fedrec_flwr.launch run|stop ...``: the launcher's command line (:func:`fedrec_flwr.launch.cli.main`)."""

import sys

from fedrec_flwr.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
