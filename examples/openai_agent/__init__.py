"""Not imported by the library: run as scripts; a package only so the import contracts see it."""
