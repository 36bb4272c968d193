"""``python -m areal_lite.engines.server``: start our server (see `areal_lite.engines.server.app`)."""

from areal_lite.engines.server.app import main

main()
