"""The client's local steps beside plain gradient descent: server-to-client guidance and FedProx's
term (:mod:`.perturbation`), SAM and ASAM (:mod:`.sharpness`)."""
