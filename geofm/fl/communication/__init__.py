"""What travels between clients and server: update codecs (:mod:`.codec`), the client's
error-feedback uplink (:mod:`.feedback`) and the server's uploads on disk (:mod:`.spill`)."""
