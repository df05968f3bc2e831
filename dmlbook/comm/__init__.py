"""Communication: what every parallelism in the book is built on.

* ``groups``: a rank's place in a group, and the block of a size each rank owns (every chapter)
* ``trace``: recording what a rank sends, in one mechanism (chapters 2, 4, 9, 9b)
"""
