"""`python -m gpucr.cli ...`: the gpucr command, as the tests, the server's start and `gpucr ps` run it."""
import sys

from . import main

sys.exit(main())
