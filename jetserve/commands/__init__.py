"""One module per `jetserve` subcommand."""
