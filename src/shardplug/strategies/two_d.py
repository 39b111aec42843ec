"""``2d``: the name of ``dp+tp``, a (data, model) mesh.

Tensor parallel within a row of devices, data parallel across rows: parameters split over
``model`` by their logical names and replicated over ``data``; the batch split over ``data``.
"""

from shardplug.plugin import Composed

TWO_D = Composed(
    "dp+tp", "2D mesh (dp+tp): tensor-parallel parameters over `model`, batch over `data`"
)
