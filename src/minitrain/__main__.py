from .apps.cli import main

# Guarded: spawned ranks re-import the main module, and must not re-run the CLI.
if __name__ == "__main__":
    raise SystemExit(main())
