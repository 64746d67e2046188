"""Deployment: ``geofm fed`` commands, certificates and node files, a deployment on one machine, the nodes' worker."""
