"""The one admission sequence every entrance goes through (``sequence``): limits, parse, what the request is, who may
do it, reservations."""
