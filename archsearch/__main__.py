import sys

from archsearch.cli import main

if __name__ == "__main__":  # engines (vLLM) spawn processes that re-import the main module
    sys.exit(main())
