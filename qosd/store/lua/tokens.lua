-- Read a bucket's tokens after refill, without writing (see _buckets.lua).
-- KEYS[1] bucket; ARGV: rate, burst. Returns tokens as a string.
return num(bucket(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]))[1])
