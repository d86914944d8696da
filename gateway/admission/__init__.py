"""The one admission sequence every entrance goes through (``sequence``); nothing here sends upstream."""
