"""The reconciler: short passes over SQL state that put back what crashes, kills and lost messages leave.

    sweep         the pass, composing the rules below (the `maintenance.sweep` task, `wavefarm maintenance`)
    dead_workers  the jobs of workers that died, hung or went away (the GPU workers run these too)
    jobs          orphan files, bells due, abandoned voices
    books         ready chapters, book folders, books left parsing: the only rules that import app.books
    report        what a pass found, and its counters
"""
