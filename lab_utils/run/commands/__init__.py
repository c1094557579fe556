"""The ``perflab`` subcommands' arguments: one light module per subcommand.

Each module holds what ``perflab <command> --help`` shows and what its arguments are
(``HELP``, ``DESCRIPTION``, ``add_arguments``), importing only the standard library, YAML and
other light modules, so ``perflab --help``, any ``--help`` and a refused argument answer at once.
``lab_utils.run.cli`` builds the parser from them and imports a command's implementation (papermill,
pandas, torch, ...) only inside that command's handler, once its arguments parse.
"""
