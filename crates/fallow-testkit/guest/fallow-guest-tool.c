/*
 * fallow-guest-tool: the static program the test guests run (and the host runs on a
 * backing file afterwards), so that a guest and the host agree on what was written.
 *
 *   fallow-guest-tool write  DEV FIRST COUNT SEED [SYNC_EVERY]
 *   fallow-guest-tool verify DEV FIRST COUNT SEED
 *   fallow-guest-tool memhog MIB SEED [ROUNDS]
 *   fallow-guest-tool zeroout DEV FIRST COUNT
 *   fallow-guest-tool zeros  DEV FIRST COUNT
 *
 * `write` fills 4 KiB blocks FIRST .. FIRST+COUNT of DEV with the pattern below, through
 * O_DIRECT (so the guest's page cache never answers for the device), and after every
 * SYNC_EVERY blocks (default: only at the end) calls fdatasync and prints
 * `FALLOW-SYNCED N`: the first N blocks are then durable, as far as the device promises.
 * `verify` reads the same blocks back and prints `FALLOW-VERIFY ok=N bad=M`, plus the
 * first few bad blocks with what they hold instead; it exits 1 if any block is bad.
 * `memhog` allocates MIB MiB, writes a pattern into every page in a random order, and
 * reads every page back ROUNDS times (default 1) in another random order, checking each:
 * a program that needs more memory than the guest has, so the guest swaps. It prints
 * `FALLOW-MEMHOG ok=N bad=M` and exits 1 if any page was wrong.
 * `zeroout` zeroes blocks FIRST .. FIRST+COUNT with the BLKZEROOUT ioctl (the kernel sends
 * the device WRITE_ZEROES when it offers it); `zeros` reads them back and prints
 * `FALLOW-ZEROS ok=N bad=M`, exiting 1 if any block holds anything but zeros.
 *
 * The pattern of block B for seed S: bytes 0-7 the magic "FLWBLOCK", 8-15 B, 16-23 S
 * (little-endian), the rest 8-byte words of splitmix64(S * 2^32 + B + word index), so a
 * block read from the wrong place, a stale block and a torn block all fail, and the report
 * says which block was found instead.
 *
 * Exit status: 0 when everything matched, 1 on a mismatch, 2 on a usage or I/O error
 * (with a line on stderr naming the call that failed).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>

#define BLOCK 4096
#define WORDS (BLOCK / 8)
#define MAGIC 0x4b434f4c42574c46ULL /* "FLWBLOCK" read as a little-endian word */
#define REPORT_BAD 5

static uint64_t splitmix64(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

static void fill_block(uint64_t *w, uint64_t block, uint64_t seed)
{
	w[0] = MAGIC;
	w[1] = block;
	w[2] = seed;
	for (uint64_t i = 3; i < WORDS; i++)
		w[i] = splitmix64((seed << 32) + block + i);
}

static int parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || end == s || *end)
		return -1;
	*out = v;
	return 0;
}

static void *aligned_block(void)
{
	void *p = NULL;
	if (posix_memalign(&p, BLOCK, BLOCK)) {
		fprintf(stderr, "fallow-guest-tool: out of memory\n");
		exit(2);
	}
	return p;
}

static int open_device(const char *dev, int flags)
{
	int fd = open(dev, flags | O_DIRECT);
	if (fd < 0 && errno == EINVAL) /* a file system without O_DIRECT (tmpfs) */
		fd = open(dev, flags);
	if (fd < 0) {
		fprintf(stderr, "fallow-guest-tool: open %s: %s\n", dev, strerror(errno));
		exit(2);
	}
	return fd;
}

static int do_write(const char *dev, uint64_t first, uint64_t count, uint64_t seed,
		    uint64_t sync_every)
{
	int fd = open_device(dev, O_WRONLY);
	uint64_t *buf = aligned_block();
	for (uint64_t n = 0; n < count; n++) {
		fill_block(buf, first + n, seed);
		ssize_t r = pwrite(fd, buf, BLOCK, (off_t)((first + n) * BLOCK));
		if (r != BLOCK) {
			fprintf(stderr, "fallow-guest-tool: write block %" PRIu64 ": %s\n",
				first + n, r < 0 ? strerror(errno) : "short write");
			return 2;
		}
		if ((sync_every && (n + 1) % sync_every == 0) || n + 1 == count) {
			if (fdatasync(fd)) {
				fprintf(stderr, "fallow-guest-tool: fdatasync after %" PRIu64
					" blocks: %s\n", n + 1, strerror(errno));
				return 2;
			}
			printf("FALLOW-SYNCED %" PRIu64 "\n", n + 1);
			fflush(stdout);
		}
	}
	close(fd);
	return 0;
}

static int do_verify(const char *dev, uint64_t first, uint64_t count, uint64_t seed)
{
	int fd = open_device(dev, O_RDONLY);
	uint64_t *buf = aligned_block(), *want = aligned_block();
	uint64_t ok = 0, bad = 0;
	for (uint64_t n = 0; n < count; n++) {
		uint64_t block = first + n;
		ssize_t r = pread(fd, buf, BLOCK, (off_t)(block * BLOCK));
		if (r != BLOCK) {
			fprintf(stderr, "fallow-guest-tool: read block %" PRIu64 ": %s\n", block,
				r < 0 ? strerror(errno) : "short read");
			return 2;
		}
		fill_block(want, block, seed);
		if (memcmp(buf, want, BLOCK) == 0) {
			ok++;
			continue;
		}
		if (bad++ < REPORT_BAD)
			printf("FALLOW-BAD block=%" PRIu64 " holds magic=%s block=%" PRIu64
			       " seed=%" PRIu64 "\n", block, buf[0] == MAGIC ? "yes" : "no",
			       buf[1], buf[2]);
	}
	printf("FALLOW-VERIFY ok=%" PRIu64 " bad=%" PRIu64 "\n", ok, bad);
	fflush(stdout);
	close(fd);
	return bad ? 1 : 0;
}

static int do_zeroout(const char *dev, uint64_t first, uint64_t count)
{
	int fd = open_device(dev, O_WRONLY);
	uint64_t range[2] = { first * BLOCK, count * BLOCK };
	if (ioctl(fd, BLKZEROOUT, range)) {
		fprintf(stderr, "fallow-guest-tool: BLKZEROOUT of blocks %" PRIu64 "+%" PRIu64
			": %s\n", first, count, strerror(errno));
		return 2;
	}
	close(fd);
	return 0;
}

static int do_zeros(const char *dev, uint64_t first, uint64_t count)
{
	int fd = open_device(dev, O_RDONLY);
	uint64_t *buf = aligned_block(), *zero = aligned_block();
	uint64_t ok = 0, bad = 0;
	memset(zero, 0, BLOCK);
	for (uint64_t block = first; block < first + count; block++) {
		ssize_t r = pread(fd, buf, BLOCK, (off_t)(block * BLOCK));
		if (r != BLOCK) {
			fprintf(stderr, "fallow-guest-tool: read block %" PRIu64 ": %s\n", block,
				r < 0 ? strerror(errno) : "short read");
			return 2;
		}
		if (memcmp(buf, zero, BLOCK) == 0)
			ok++;
		else if (bad++ < REPORT_BAD)
			printf("FALLOW-BAD block=%" PRIu64 " is not zeros\n", block);
	}
	printf("FALLOW-ZEROS ok=%" PRIu64 " bad=%" PRIu64 "\n", ok, bad);
	fflush(stdout);
	close(fd);
	return bad ? 1 : 0;
}

/* A random permutation of 0 .. n-1 (Fisher-Yates, splitmix64 as the generator). */
static uint64_t *permutation(uint64_t n, uint64_t seed)
{
	uint64_t *p = malloc(n * sizeof *p);
	if (!p) {
		fprintf(stderr, "fallow-guest-tool: out of memory for %" PRIu64 " indexes\n", n);
		exit(2);
	}
	for (uint64_t i = 0; i < n; i++)
		p[i] = i;
	for (uint64_t i = n; i > 1; i--) {
		seed = splitmix64(seed);
		uint64_t j = seed % i, t = p[i - 1];
		p[i - 1] = p[j];
		p[j] = t;
	}
	return p;
}

static int do_memhog(uint64_t mib, uint64_t seed, uint64_t rounds)
{
	uint64_t pages = mib * 256;
	uint64_t *order = permutation(pages, seed);
	unsigned char *mem = mmap(NULL, pages * BLOCK, PROT_READ | PROT_WRITE,
				  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		fprintf(stderr, "fallow-guest-tool: mmap %" PRIu64 " MiB: %s\n", mib,
			strerror(errno));
		return 2;
	}
	for (uint64_t i = 0; i < pages; i++)
		fill_block((uint64_t *)(mem + order[i] * BLOCK), order[i], seed);
	uint64_t *want = aligned_block(), ok = 0, bad = 0;
	for (uint64_t round = 0; round < rounds; round++) {
		free(order);
		order = permutation(pages, seed + round + 1);
		for (uint64_t i = 0; i < pages; i++) {
			fill_block(want, order[i], seed);
			if (memcmp(mem + order[i] * BLOCK, want, BLOCK) == 0)
				ok++;
			else
				bad++;
		}
	}
	printf("FALLOW-MEMHOG ok=%" PRIu64 " bad=%" PRIu64 "\n", ok, bad);
	fflush(stdout);
	return bad ? 1 : 0;
}

static int usage(void)
{
	fprintf(stderr, "usage: fallow-guest-tool write DEV FIRST COUNT SEED [SYNC_EVERY]\n"
			"       fallow-guest-tool verify DEV FIRST COUNT SEED\n"
			"       fallow-guest-tool memhog MIB SEED [ROUNDS]\n"
			"       fallow-guest-tool zeroout DEV FIRST COUNT\n"
			"       fallow-guest-tool zeros DEV FIRST COUNT\n");
	return 2;
}

int main(int argc, char **argv)
{
	uint64_t a, b, c, d = 0;
	if (argc >= 6 && !strcmp(argv[1], "write") && argc <= 7) {
		if (parse_u64(argv[3], &a) || parse_u64(argv[4], &b) || parse_u64(argv[5], &c) ||
		    (argc == 7 && parse_u64(argv[6], &d)))
			return usage();
		return do_write(argv[2], a, b, c, d);
	}
	if (argc == 6 && !strcmp(argv[1], "verify")) {
		if (parse_u64(argv[3], &a) || parse_u64(argv[4], &b) || parse_u64(argv[5], &c))
			return usage();
		return do_verify(argv[2], a, b, c);
	}
	if ((argc == 4 || argc == 5) && !strcmp(argv[1], "memhog")) {
		d = 1;
		if (parse_u64(argv[2], &a) || parse_u64(argv[3], &b) ||
		    (argc == 5 && parse_u64(argv[4], &d)) || a == 0)
			return usage();
		return do_memhog(a, b, d);
	}
	if (argc == 5 && (!strcmp(argv[1], "zeroout") || !strcmp(argv[1], "zeros"))) {
		if (parse_u64(argv[3], &a) || parse_u64(argv[4], &b))
			return usage();
		return strcmp(argv[1], "zeroout") ? do_zeros(argv[2], a, b) : do_zeroout(argv[2], a, b);
	}
	return usage();
}
