class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with code 2."""
