"""PiCA's process reward model: labelled data, the model and its loss, training, the scorer and its server."""
