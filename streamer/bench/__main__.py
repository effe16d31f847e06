"""`python -m streamer.bench ...` works like `streamer bench ...`."""
import sys

from streamer.bench.cli import main

sys.exit(main())
