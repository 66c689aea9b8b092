"""``python -m models.algorithms [FILE.md]``: print the algorithms table, or refresh it in FILE.md."""

import sys

from models.algorithms.docs_table import markdown_table, write

if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(f"{sys.argv[1]}: {'updated' if write(sys.argv[1]) else 'already current'}")
    else:
        print(markdown_table())
