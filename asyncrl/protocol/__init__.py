"""What the controller and the workers exchange: commands and events (messages.py), and the
header the controller reads of each group instead of its tokens (headers.py)."""
