"""``python -m appliance`` = the ``appliance`` command (the systemd unit and the background server use this)."""
from appliance.cli import app

app(prog_name="appliance")
