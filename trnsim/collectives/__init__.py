"""NeuronLink collectives (topology, links, algorithms): not modelled yet."""
