"""``python -m amplite`` runs the same CLI as the ``amplite`` script."""

from amplite.cli import main

if __name__ == "__main__":
    main()
