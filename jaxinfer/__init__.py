from jaxinfer.loaders import LoadedModel, load
