import sys

from streamer.cli import main

sys.exit(main())
