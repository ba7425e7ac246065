"""`python -m memtrain ...` (also how the DeepSpeed launcher starts it: `deepspeed --module memtrain ...`)."""

import sys

from memtrain.launcher.cli import main

sys.exit(main())
