"""What a whole model's state is under any layout: the placement of every state_dict entry (placement.py), slices
of whole parameters (slices.py), and the whole state gathered from any layout (whole_state.py)."""
