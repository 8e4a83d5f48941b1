import os
import sys

# Spawned children unpickle test functions by module name: make tests/ importable for them.
sys.path.insert(0, os.path.dirname(__file__))
