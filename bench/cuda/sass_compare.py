#!/usr/bin/env python3
"""Per-function SASS of CUDA objects, normalised (label numbers renumbered by first appearance),
compared between two builds. Usage: sass_compare.py OUTDIR OLD_OBJ... -- NEW_OBJ...  (CUOBJDUMP: the cuobjdump to use)
Prints, per kernel entry and architecture, whether the two builds' SASS is identical (instruction
words included; whitespace and label numbers normalised), and writes both listings to OUTDIR.
Names are demangled with c++filt; canon() maps renamed template parameter lists (here: the
cleanup that dropped MMA_DIAG and WG, and STATE_SCALES's default):
  chunk_forward_kernel<DK, DK, E, true>            -> chunk_forward_kernel<DK, E>
  chunk_forward_ws_kernel<DK, E, RS, L, false, A>  -> chunk_forward_ws_kernel<DK, E, RS, L, A>
  chunk_forward_ws_kernel<DK, E, RS, L, H, P, 0>   -> chunk_forward_ws_kernel<DK, E, RS, L, H, P>"""
import re, subprocess, sys, os, collections

def sass(objs):
    funcs = {}
    for obj in objs:
        out = subprocess.run([os.environ.get('CUOBJDUMP', 'cuobjdump'), '-sass', obj], capture_output=True, text=True, check=True).stdout
        arch = None; name = None; body = []
        def flush():
            if name is not None:
                funcs[(arch, name)] = body[:]
        for line in out.split('\n'):
            m = re.match(r'\s*code for (sm_\w+)', line)
            if m:
                flush(); name = None; body = []; arch = m.group(1); continue
            if line.startswith('Fatbin') or line.startswith('====='):
                flush(); name = None; body = []; continue
            m = re.match(r'\s*Function : (\S+)', line)
            if m:
                flush(); name = m.group(1); body = []; continue
            if name is not None and line.strip():
                body.append(line.rstrip())
        flush()
    return funcs

def demangle(names):
    out = subprocess.run(['c++filt'], input='\n'.join(names), capture_output=True, text=True, check=True).stdout
    return out.strip('\n').split('\n')

def canon(d):
    d = re.sub(r'chunk_forward_kernel<(\d+), \1, ([\w:]+), true>', r'chunk_forward_kernel<\1, \2>', d)
    d = re.sub(r'chunk_forward_ws_kernel<(\d+), ([\w:]+), (\d+), (\d+), false, (true|false)>', r'chunk_forward_ws_kernel<\1, \2, \3, \4, \5>', d)
    d = re.sub(r'chunk_forward_ws_kernel<(\d+), ([\w:]+), (\d+), (\d+), (\d+), (\d+), 0>', r'chunk_forward_ws_kernel<\1, \2, \3, \4, \5, \6>', d)
    return d

def normalise(body):
    labels = {}
    def lab(m):
        k = m.group(0)
        if k not in labels: labels[k] = '.L_%d' % len(labels)
        return labels[k]
    return [re.sub(r'\s+', ' ', re.sub(r'\.L_x_\d+', lab, l)).strip() for l in body]

def load(objs):
    f = sass(objs)
    keys = list(f)
    dem = demangle([k[1] for k in keys])
    return {(k[0], canon(d)): normalise(f[k]) for k, d in zip(keys, dem)}

outdir = sys.argv[1]
i = sys.argv.index('--')
old, new = load(sys.argv[2:i]), load(sys.argv[i + 1:])
os.makedirs(outdir, exist_ok=True)
same = diff = 0
for key in sorted(new):
    arch, name = key
    if key not in old:
        print('NEW ONLY', arch, name); diff += 1; continue
    if old[key] == new[key]:
        same += 1
    else:
        diff += 1
        print('DIFFERS', arch, name, len(old[key]), len(new[key]))
    safe = re.sub(r'[^\w]+', '_', arch + '_' + name)[:150]
    open(os.path.join(outdir, safe + '.old.sass'), 'w').write('\n'.join(old[key]) + '\n')
    open(os.path.join(outdir, safe + '.new.sass'), 'w').write('\n'.join(new[key]) + '\n')
removed = sorted(k for k in old if k not in new)
by = collections.Counter(a for a, _ in removed)
print('entries in new: %d, identical: %d, differing or new: %d' % (len(new), same, diff))
print('entries only in old (removed): %d %s' % (len(removed), dict(by)))
for a, n in removed: print('  removed', a, n)
